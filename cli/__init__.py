"""The `fleetloop` command: the face over flows, `dvc repro` stages and the fleet runtime (typer + rich).

    main.py      the top-level commands (demo, retrain, ingest, stage, status, lineage, ui, serve, ...)
    fleet.py     `fleetloop fleet ...`: the FATS runtime from the shell
    reports.py   what `status` and `lineage` print
    services.py  `fleetloop ui`: the Prefect server and the MLflow UI on loopback

`flows/` holds Prefect flows only; this package imports them lazily so `--help` stays fast.
"""
