"""`python -m focaljax.convert {hf-to-focaljax,focaljax-to-hf} ...`: the conversion command line
(the code lives in focaljax.interop.hf)."""

import sys

from focaljax.interop.hf import main

if __name__ == "__main__":
  sys.exit(main())
