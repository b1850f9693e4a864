from bucketfs.cli import main

raise SystemExit(main())
