"""Test tooling shipped with dtorch (importable without a cluster): `dtorch.testing.conformance`."""
