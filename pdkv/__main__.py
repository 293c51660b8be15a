from pdkv.die_with_parent import arm_from_env

arm_from_env()  # before anything slow: a child of `pdkv up` must not outlive it

from pdkv.cli import main  # noqa: E402

raise SystemExit(main())
