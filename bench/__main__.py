import sys
from tinyhet.bench import main
sys.exit(main())
