import sys

from mpgemm.app.cli import main

sys.exit(main())
