"""Compiles the units of fusedopt_torch's library-rule classes in parallel (CPU and CUDA; float32,
bfloat16, and float64 for Rprop's torch-suite run) before their tests and bench/library_rules.py,
which would otherwise compile them one at a time at their first steps. Prints what failed."""

import concurrent.futures
import sys
import time

import torch

import fusedopt_torch as ft

CLASSES = [ft.Rprop, ft.ASGD, ft.AdEMAMix, ft.Adan, ft.ADOPT, ft.StableAdamW, ft.CAdamW, ft.ScheduleFreeAdamW, ft.ScheduleFreeSGD]


def main():
    start = time.time()
    ft.extension()
    print(f"core {time.time() - start:.1f} s", flush=True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    jobs = [(c, d, t) for c in CLASSES for d in devices for t in (torch.float32, torch.bfloat16)]
    jobs += [(c, d, torch.float64) for c in (ft.Rprop, ft.ASGD) for d in devices]

    def build(job):
        try:
            job[0].compile(job[1], job[2])
            return None
        except Exception as e:  # reported, and the tests then fail with the same error
            return f"{job[0].__name__} {job[1]} {job[2]}: {e}"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        errors = [e for e in pool.map(build, jobs) if e]
    print(f"{len(jobs)} units in {time.time() - start:.1f} s; {len(errors)} failed", *errors, sep="\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
