from pdkv.cli import main

raise SystemExit(main())
