import sys

from tornchat.cli import main

sys.exit(main())
