import sys

from infinity.cli.main import main

sys.exit(main())
