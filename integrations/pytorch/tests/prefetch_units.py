"""Compiles units in parallel before a test run that would compile them one at a time at first
steps: the library-rule classes' (CPU and CUDA; float32, bfloat16, and float64 for Rprop's and
ASGD's torch-suite runs; test_library_rules.py, bench/library_rules.py), test_rules.py's user
rules (its PREFETCH), the built-in optimizers' of test_in_backward.py (one first step each, on a
small model, in threads), and Muon's, Adafactor's, CAME's and Prodigy's (test_muon.py,
test_adafactor.py, test_came.py, test_prodigy.py, bench/muon.py). `prefetch_units.py muon`:
Muon's, Adafactor's, CAME's, Prodigy's and AdamW's only; `prefetch_units.py adafactor came
prodigy` (any of the three): those units only, without the core extension. Prints what failed;
exit status 1 if anything did."""

import concurrent.futures
import sys
import time

import torch

import fusedopt_torch as ft
from fusedopt_torch import _adafactor_unit, _came_unit, _ext, _muon_unit, _prodigy_unit

CLASSES = [ft.Rprop, ft.ASGD, ft.AdEMAMix, ft.Adan, ft.ADOPT, ft.StableAdamW, ft.CAdamW, ft.ScheduleFreeAdamW, ft.ScheduleFreeSGD]


def main():
    start = time.time()
    only = set(sys.argv[1:]) if sys.argv[1:] and set(sys.argv[1:]) <= {"adafactor", "came", "prodigy"} else None
    if only is None:
        ft.extension()
        print(f"core {time.time() - start:.1f} s", flush=True)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    units_only = sys.argv[1:] == ["muon"] or only is not None  # no library-rule classes
    jobs = []  # (rule class, device, dtype[, GradScaler's kernel]): its compile()'s arguments
    if not units_only:
        import test_rules  # its user rules (importing compiles nothing)

        jobs = [(c, d, t) for c in CLASSES for d in devices for t in (torch.float32, torch.bfloat16)]
        jobs += [(c, d, torch.float64) for c in (ft.Rprop, ft.ASGD) for d in devices]
        jobs += [(c, d, t, amp) for c, t, amp, cuda_only in test_rules.PREFETCH for d in devices
                 if d == "cuda" or not cuda_only]
    # (what, device, dtype, the unit's compile call with (backend, dtype, archs))
    unit_jobs = [(f"Muon NS {ns}", d, t, lambda backend, dtype, archs, ns=ns: _muon_unit.unit(backend, dtype, ns, archs))
                 for d in devices for t, ns in (("float32", "bfloat16"), ("float32", "float32"), ("bfloat16", "bfloat16"))]
    unit_jobs += [("Adafactor", d, t, _adafactor_unit.unit) for d in devices for t in ("float32", "bfloat16")]
    unit_jobs += [("CAME", d, t, _came_unit.unit) for d in devices for t in ("float32", "float64", "bfloat16")]
    unit_jobs += [("Prodigy", d, t, lambda backend, dtype, archs: _prodigy_unit.unit(backend, dtype, True, archs))
                  for d in devices for t in ("float32", "float64", "bfloat16")]
    if only is not None:
        unit_jobs = [job for job in unit_jobs if job[0].lower() in only]

    def build(job):
        try:
            job[0].compile(*job[1:])
            return None
        except Exception as e:  # reported, and the tests then fail with the same error
            return f"{job[0].__name__} {' '.join(map(str, job[1:]))}: {e}"

    def build_unit(job):
        what, device, dtype, compile_unit = job
        try:
            compile_unit("cuda" if device == "cuda" else "host", dtype, (_ext.arch_of(0),) if device == "cuda" else ())
            return None
        except Exception as e:
            return f"{what} {device} {dtype}: {e}"

    def first_step(job):
        make, device = job
        try:
            params = [torch.zeros(4, 3, device=device, requires_grad=True), torch.zeros(3, device=device, requires_grad=True)]
            for p in params:
                p.grad = torch.ones_like(p)
            make(params).step()
            return None
        except Exception as e:
            return f"first step on {device}: {e}"

    builtins = [lambda ps: ft.AdamW(ps), lambda ps: ft.Adam(ps, amsgrad=True), lambda ps: ft.SGD(ps, momentum=0.9, nesterov=True),
                lambda ps: ft.Lion(ps), lambda ps: ft.LAMB(ps, max_grad_norm=0.0)]
    if units_only:
        builtins = [] if only is not None else builtins[:1]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        steps = pool.map(first_step, [(b, d) for b in builtins for d in devices])
        units = pool.map(build_unit, unit_jobs)
        errors = [e for e in pool.map(build, jobs) if e] + [e for e in steps if e] + [e for e in units if e]
    print(f"{len(jobs)} rule units, {len(unit_jobs)} Muon, Adafactor, CAME and Prodigy units and {len(builtins) * len(devices)} first steps in "
          f"{time.time() - start:.1f} s; "
          f"{len(errors)} failed", *errors, sep="\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
