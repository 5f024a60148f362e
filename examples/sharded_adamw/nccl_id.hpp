// One NCCL id for every rank of a job started as separate processes without MPI: rank 0 makes
// it and publishes it in a file, the others wait for the file. Shared by this example and
// bench/sharded_overlap.cu.
#pragma once

#include <fusedopt/error.hpp>
#include <fusedopt/nccl.cuh>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

namespace fusedopt_examples {

/// Rank 0 makes the id and publishes it in `path` (written beside it, then renamed: readers
/// never see half an id); the others wait for the file, up to a minute.
/// @throws fusedopt::error when the file cannot be written, or no id appears in time.
inline ncclUniqueId shared_nccl_id(int rank, int world, std::string const& path)
{
  ncclUniqueId id{};
  if (world == 1 || rank == 0) {
    FUSEDOPT_NCCL_TRY(ncclGetUniqueId(&id));
    if (world > 1) {
      std::string const partial = path + ".partial";
      {
        std::ofstream out(partial, std::ios::binary);
        out.write(id.internal, sizeof id.internal);
        if (!out) { throw fusedopt::error("cannot write the NCCL id to " + partial); }
      }
      if (std::rename(partial.c_str(), path.c_str()) != 0) {
        throw fusedopt::error("cannot rename " + partial + " to " + path);
      }
    }
    return id;
  }
  for (int tries = 0; tries < 600; ++tries) {
    std::ifstream in(path, std::ios::binary);
    if (in.read(id.internal, sizeof id.internal)) { return id; }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw fusedopt::error("no NCCL id in " + path + " after a minute (did rank 0 start?)");
}

}  // namespace fusedopt_examples
