"""Only the C extension lives here; everything else is in pyproject.toml.

kvtier.store._xxcopy copies a payload and computes its XXH3-64 checksum in one pass (the disk tier's
verified loads; src/kvtier/store/_xxcopy.c). It is optional: where it cannot be compiled (no C
compiler), kvtier installs without it and checksums with python-xxhash (slower loads, the same
values).

The same module computes the AES-256-GMAC of a keyed payload (a tenant secret) in one pass that
also copies it (keyed loads) or checksums it (keyed saves), with AES-NI and the CPU's carry-less
multiply (src/kvtier/store/_ghash.h); without it the `cryptography` package computes the same tags.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.store._xxcopy", ["src/kvtier/store/_xxcopy.c"], optional=True,
                             depends=["src/kvtier/store/_ghash.h"], extra_compile_args=["-O3"])])
