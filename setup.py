"""Packages are discovered, never listed: the design card's top-level folders map
onto import names (client/ -> tierstore.client, ...), and every sub-package under
them ships (tests/test_wheel.py installs the built wheel and serves a table)."""
from setuptools import find_packages, setup

ROOTS = {"tierstore": "tierstore", "tierstore.client": "client", "tierstore.kernels": "kernels",
         "tierstore.bench": "bench", "tierstore.proto": "proto"}

packages = []
for name, folder in ROOTS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
