"""The control panel's screens: the dashboard (default), the plan editor (p), the model screen (m) and the key
help (?)."""

from .dashboard import DashboardScreen
from .help import HelpScreen
from .model import ModelScreen
from .plan import PlanScreen

__all__ = ["DashboardScreen", "HelpScreen", "ModelScreen", "PlanScreen"]
