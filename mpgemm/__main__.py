import sys

from mpgemm.cli import main

sys.exit(main())
