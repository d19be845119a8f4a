"""The learned router as an MLflow ``pyfunc`` model (what the registry holds and serving loads).

Input: a DataFrame, one row per routing request:

==============  ==================  ====================================================
column          type                meaning
==============  ==================  ====================================================
``request_id``  string (optional)   echoed back
``offerings``   array of double     the offering feature rows, flattened row-major
                                    (``n * len(envs.features.OFFERING_FEATURES)``; any n)
``request``     array of double     the request features (``envs.features.REQUEST_FEATURES``)
``mask``        array of double     1 = the offering may take the request (length n)
==============  ==================  ====================================================

Output: a DataFrame with ``request_id`` (when given), ``offering_index`` (the chosen row; -1
when no offering is valid), ``score`` (its score) and ``scores`` (every row's score, NaN where
masked). Numpy only: no torch, no stable-baselines3.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
from models.policy import RouterWeights, read_router

ARTIFACT_KEY = "router"


def predict_frame(weights: RouterWeights, model_input: pd.DataFrame) -> pd.DataFrame:
    """Route every row of ``model_input`` with ``weights``."""
    missing = [c for c in ("offerings", "request", "mask") if c not in model_input.columns]
    if missing:
        raise ValueError(f"input is missing column(s) {', '.join(missing)}")
    out: dict[str, list[Any]] = {"offering_index": [], "score": [], "scores": []}
    for k, row in enumerate(model_input.itertuples(index=False)):
        rows = np.asarray(row.offerings, dtype=np.float32)
        mask = np.asarray(row.mask, dtype=np.float32)
        req = np.asarray(row.request, dtype=np.float32)
        n = mask.size
        if rows.size != n * N_OFFERING_FEATURES or req.size != N_REQUEST_FEATURES:
            raise ValueError(f"row {k}: 'offerings' has {rows.size} values and 'mask' {n}; expected "
                             f"{N_OFFERING_FEATURES} per offering and {N_REQUEST_FEATURES} request features")
        s = weights.scores(rows.reshape(1, n, N_OFFERING_FEATURES), req[None], mask[None])[0].astype(float)
        valid = mask > 0.5
        best = int(np.argmax(np.where(valid, s, -np.inf))) if valid.any() else -1
        out["offering_index"].append(best)
        out["score"].append(float(s[best]) if best >= 0 else float("nan"))
        out["scores"].append(np.where(valid, s, np.nan).tolist())
    df = pd.DataFrame(out)
    if "request_id" in model_input.columns:
        df.insert(0, "request_id", model_input["request_id"].astype(str).to_numpy())
    return df


class RouterModel(PythonModel):
    """``mlflow.pyfunc`` wrapper of an exported router (artifact ``router``: the export directory)."""

    def load_context(self, context: Any) -> None:
        self.weights = read_router(context.artifacts[ARTIFACT_KEY])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return predict_frame(self.weights, model_input)


def example_frame(observations: list[dict[str, np.ndarray]], n: int, request_ids: list[str] | None = None
                  ) -> pd.DataFrame:
    """Model input for environment observations, cut to the catalog's ``n`` offerings."""
    return pd.DataFrame({
        **({"request_id": request_ids} if request_ids is not None else {}),
        "offerings": [np.asarray(o["offerings"][: n * N_OFFERING_FEATURES], dtype=float) for o in observations],
        "request": [np.asarray(o["request"], dtype=float) for o in observations],
        "mask": [np.asarray(o["mask"][:n], dtype=float) for o in observations],
    })
