from dockd.cli import main

raise SystemExit(main())
