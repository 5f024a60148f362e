// Adafactor (torch.optim.Adafactor's algorithm, docs/rules.md) over a small model: a weight
// matrix, a batch of matrices and a bias. Its second moment is factored: per matrix, a row
// statistic per row and a column statistic per column (the bias, a vector, keeps one per
// element), which the caller allocates beside the parameters, as optimizer state. A
// factored_layout sizes them from the shapes, and its entries are the table the rule reads.
// The example fits the parameters to a target (gradient = param - target) and prints the
// distance each few steps, and what the statistics weigh against a full second moment.
//
// On a GPU the same layout serves: allocate the statistics, the workspace and the entries in
// device memory (cudaMalloc), copy `entries` there, give the table the device copy, and make
// the plan with longer chunks, which rules over factored statistics run faster with:
//   fo::cuda::options opts;
//   opts.chunk_elements = fo::factored_chunk_elements;
//   auto plan = fo::cuda::make_plan(lists, opts, stream);
#include <fusedopt/fusedopt.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace fo = fusedopt;

int main()
{
  // Shapes as torch gives them: the last two dimensions are a matrix, leading ones a batch.
  std::vector<std::vector<std::int64_t>> const shapes{{300, 200}, {4, 64, 96}, {200}};

  fo::factored_layout layout;
  for (auto const& shape : shapes) { layout.add_torch_shape(shape); }

  std::size_t const count = shapes.size();
  std::vector<std::vector<float>> params(count), targets(count), grads(count), rows(count), cols(count);
  fo::tensor_list<float> param_list;
  fo::tensor_list<float const> grad_list;
  std::vector<float*> row_pointers, col_pointers;
  std::int64_t elements = 0, statistics = 0;
  for (std::size_t t = 0; t < count; ++t) {
    auto const n = static_cast<std::size_t>(layout.elements(t));
    params[t].resize(n);
    targets[t].resize(n);
    grads[t].resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      params[t][i] = 0.1f * std::sin(0.7f * static_cast<float>(i) + static_cast<float>(t));
      targets[t][i] = std::cos(0.3f * static_cast<float>(i));
    }
    // Statistics start at zero (torch's zeros); a vector has row statistics only.
    rows[t].assign(static_cast<std::size_t>(layout.row_elements(t)), 0.f);
    cols[t].assign(static_cast<std::size_t>(layout.col_elements(t)), 0.f);
    row_pointers.push_back(rows[t].data());
    col_pointers.push_back(cols[t].empty() ? nullptr : cols[t].data());
    param_list.push_back(params[t].data(), layout.elements(t));
    grad_list.push_back(grads[t].data(), layout.elements(t));
    elements += layout.elements(t);
    statistics += layout.row_elements(t) + layout.col_elements(t);
  }
  // The factored pass's workspace (tile partials, row totals, line factors): doubles, allocated
  // once with the state; a step allocates nothing.
  std::vector<double> workspace(static_cast<std::size_t>(layout.workspace_doubles()));
  auto const entries = layout.entries<float>(row_pointers, col_pointers, workspace.data());

  fo::rules::adafactor adafactor;
  adafactor.lr = 5e-2;
  adafactor.statistics = layout.table<float>(entries.data());
  auto plan = fo::host::make_plan(fo::bind(fo::slot::param = param_list, fo::slot::grad = grad_list));

  auto distance = [&] {
    double sum = 0;
    for (std::size_t t = 0; t < count; ++t) {
      for (std::size_t i = 0; i < params[t].size(); ++i) {
        double const d = params[t][i] - targets[t][i];
        sum += d * d;
      }
    }
    return std::sqrt(sum / static_cast<double>(elements));
  };
  std::printf("step   0: RMS distance to the target %.3e\n", distance());
  for (std::int64_t step = 1; step <= 300; ++step) {
    for (std::size_t t = 0; t < count; ++t) {
      for (std::size_t i = 0; i < params[t].size(); ++i) { grads[t][i] = params[t][i] - targets[t][i]; }
    }
    plan.run(adafactor, fo::step_info{step});
    if (step % 100 == 0) {
      std::printf("step %3lld: RMS distance to the target %.3e\n", static_cast<long long>(step), distance());
    }
  }
  std::printf("second moment: %lld factored statistics for %lld elements (a full one: %lld)\n",
              static_cast<long long>(statistics), static_cast<long long>(elements), static_cast<long long>(elements));
  double const final_distance = distance();
  return std::isfinite(final_distance) && final_distance < 1e-2 ? 0 : 1;
}
