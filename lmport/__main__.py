"""`python -m lmport`: the `lmport` command."""
import sys

from lmport.entrypoints.cli import main

sys.exit(main())
