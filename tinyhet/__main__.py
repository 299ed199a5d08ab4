import sys
from tinyhet.cli.main import main
sys.exit(main())
