import sys

from omnistage.cli.main import main

sys.exit(main())
