import sys
from tinyhet.cli import main
sys.exit(main())
