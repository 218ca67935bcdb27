"""MLflow tracking of calls, across the three processes a call involves.

- `listener`: in the notebook, the runner listener that makes each call's run, hands the ranks its
  id, relays what remote ranks logged, and ends the run.
- `prepare`: in the notebook, MLflow's import and its store's first set-up, started in the background
  when the extension loads, which the first call's listener waits for.
- `ui`: in the notebook, the link to a run, and the local MLflow UI started on demand behind it.
- `hook`: in every rank of a tracked call, the hook that patches mlflow if (and only if) the user's
  code imports it; also the warm-up a warm helper runs.
- `relay`: in a rank that cannot reach a local store, the MLflow store that writes to a file the
  launcher carries back; the line format's writer and reader.
- `tee`: the live charts' copy of logged metrics; the line format's writer and reader.
- `orphans`: the MLflow run of a call whose owner died, ended FAILED by the first process that finds it.
- `_compat`: the only module that touches MLflow's private names.

Importing this package imports nothing: the ranks import `hook` alone, which imports mlflow only
when their code does, and nothing of IPython or ipywidgets.
"""
