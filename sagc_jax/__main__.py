import sys

from sagc_jax.cli import main

sys.exit(main())
