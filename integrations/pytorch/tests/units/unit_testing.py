"""What the torch-free tests of the ctypes units share (test_muon_unit.py, test_adafactor_unit.py,
test_prodigy_unit.py): float32 buffers and their addresses, the distance they are compared by, and
a test case whose units compile into a temporary cache."""
import array
import os
import tempfile
import unittest


def floats(values):
    """A float32 buffer of `values` (what a unit reads and writes through its address)."""
    return array.array("f", values)


def address(buffer):
    return buffer.buffer_info()[0]


def worst(got, want):
    """The largest difference, relative to the tensor's largest magnitude."""
    scale = max([abs(w) for w in want] + [1e-30])
    return max([abs(a - b) for a, b in zip(got, want)] + [0.0]) / scale


class UnitTestCase(unittest.TestCase):
    """Units compiled into a temporary cache for the test case: `make_units()` (the subclass's)
    compiles and loads them once for the class."""

    @classmethod
    def setUpClass(cls):
        cls.cache = tempfile.TemporaryDirectory()
        os.environ["FUSEDOPT_TORCH_CACHE"] = cls.cache.name
        os.environ.setdefault("FUSEDOPT_TORCH_QUIET", "1")
        cls.make_units()

    @classmethod
    def tearDownClass(cls):
        cls.cache.cleanup()

    @classmethod
    def make_units(cls):
        raise NotImplementedError
