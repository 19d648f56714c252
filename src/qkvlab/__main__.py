from qkvlab.cli import main

raise SystemExit(main())
