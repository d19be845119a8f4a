"""The planner model as MLflow builds it when it loads a registered version ("models from code":
``models.planner_tracking.log_planner_model`` logs this file as ``python_model``), so loading
unpickles nothing. xroute itself never imports it."""

from mlflow.models import set_model

from models.planner_pyfunc import PlannerModel

set_model(PlannerModel())
