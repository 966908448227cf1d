from cdcd.cli import main

raise SystemExit(main())
