import sys

from dflashkit.cli.main import main

sys.exit(main())
