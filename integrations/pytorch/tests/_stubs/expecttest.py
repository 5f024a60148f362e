"""A stand-in for the `expecttest` package, which torch.testing._internal.common_utils imports.

torch's test utilities derive their TestCase from expecttest.TestCase (assertExpectedInline
rewrites expected strings in test sources). The device machine has no expecttest and nothing can
be installed there; fusedopt's harness uses none of its features, so test_torch_suite.py puts
this module on sys.path only when the real one is missing.
"""

import unittest


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 - expecttest's name
        self.assertEqual(actual, expect)

    def assertExpectedRaisesInline(self, exc_type, callable_, expect, *args, **kwargs):  # noqa: N802
        with self.assertRaises(exc_type) as ctx:
            callable_(*args, **kwargs)
        self.assertEqual(str(ctx.exception), expect)
