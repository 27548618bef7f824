import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from caffempi.tools.classify import main
raise SystemExit(main())
