"""The benchmarks' workloads W1-W4 as tensor sizes, as bench/workloads.hpp draws them (W3 with the
same splitmix64 stream), for the Python benches of every framework (no torch or jax import here).
"""

MASK64 = (1 << 64) - 1
W3_SEED = 20240404


def splitmix64(state):
    """One step of splitmix64: returns (new_state, output), as in workloads.hpp."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def log_uniform_sizes(count, seed):
    sizes = []
    state = seed
    for _ in range(count):
        state, z = splitmix64(state)
        u = (z >> 11) * 2.0**-53
        # C++ std::llround rounds halves away from zero; Python's round() to even. Never a
        # tie here in practice, but keep the C++ rule.
        x = 2.0 ** (8.0 + 8.0 * u)
        sizes.append(int(x + 0.5))
    return sizes


def gpt2_small_sizes():
    d = 768
    sizes = [50257 * d, 1024 * d]
    for _ in range(12):
        sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return sizes + [d, d]


WORKLOADS = {
    "W1": ("10 x 1024x1024", lambda: [1 << 20] * 10),
    "W2": ("GPT-2 small, 148 tensors", gpt2_small_sizes),
    "W3": ("2000 x log-uniform 256..65536", lambda: log_uniform_sizes(2000, W3_SEED)),
    "W4": ("1 x 268435456", lambda: [1 << 28]),
}
