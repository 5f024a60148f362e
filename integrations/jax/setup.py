"""fusedopt_jax as an installable package: ``pip install ./integrations/jax`` (offline, with jax
and optax already installed: ``pip install --no-build-isolation --no-deps ./integrations/jax``).

Nothing is compiled at install: the package carries csrc/ and fusedopt's headers (``_csrc``,
``_include``), and a step compiles the FFI handler and the units it needs into the cache
(fusedopt_jax/_build.py), as from a checkout. ``python -m fusedopt_jax._build`` builds every
unit ahead.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SOURCES = ((HERE.parent.parent / "include", "_include"), (HERE / "csrc", "_csrc"))


class BuildPy(build_py):
    """The package with the sources its on-demand compiles need (no checkout beside it)."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "fusedopt_jax"
        for source, name in SOURCES:
            if not source.is_dir():
                raise SystemExit(f"fusedopt_jax: {source} not found: build from a fusedopt checkout")
            shutil.rmtree(target / name, ignore_errors=True)
            shutil.copytree(source, target / name)


setup(
    name="fusedopt_jax",
    version="0.1.0",
    description="fusedopt's fused multi-tensor optimizer steps in JAX (Optax-compatible), through the XLA FFI",
    packages=["fusedopt_jax"],
    python_requires=">=3.9",
    install_requires=["jax>=0.4.31", "optax"],
    cmdclass={"build_py": BuildPy},
    zip_safe=False,
)
