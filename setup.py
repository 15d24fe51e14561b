"""The one compiled part: landing's reader of plain OpenAI response bodies (clawpipe/lake/_openai_scan.c).

Optional: where no C compiler is, the install goes on and landing reads those bodies with msgspec instead
(slower, the same columns). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("clawpipe.lake._openai_scan", ["clawpipe/lake/_openai_scan.c"], optional=True)])
