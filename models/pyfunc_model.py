"""The router model as MLflow builds it when it loads a registered version ("models from code":
``models.registry.log_router_model`` logs this file as ``python_model``; MLflow copies it into the
model and runs it at load, with the model's ``code/`` first on ``sys.path``), so loading unpickles
nothing. xroute itself never imports it."""

from mlflow.models import set_model

from models.pyfunc import RouterModel

set_model(RouterModel())
