"""Only the C extension lives here; everything else is in pyproject.toml.

kvtier.store._xxcopy copies a payload and computes its XXH3-64 checksum in one pass (the disk tier's
verified loads; src/kvtier/store/_xxcopy.c). It is optional: where it cannot be compiled (no C
compiler), kvtier installs without it and checksums with python-xxhash (slower loads, the same
values). The keyed MAC (AES-256-GMAC) is not in C: `cryptography` (OpenSSL) computes it.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.store._xxcopy", ["src/kvtier/store/_xxcopy.c"], optional=True,
                             extra_compile_args=["-O3"])])
