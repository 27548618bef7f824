import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from caffempi.tools.upgrade_proto import upgrade_net_proto_binary as main
raise SystemExit(main())
