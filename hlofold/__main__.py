import sys

from hlofold._front.cli import main

sys.exit(main())
