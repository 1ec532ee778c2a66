"""What the wheel ships: every package found under gateway/, rollout_store/, trainer_client/, training_data/
and migrations/, with every file in them that is not Python source (the viewer's pages, scripts and styles;
alembic's revision template), so that a new package or asset ships without anyone listing it. The rest of the
metadata is in pyproject.toml, which cannot both find packages and map one to another directory: the
migrations stay at the top of the repository, where alembic.ini finds them, and ship inside the package as
rollout_store.migrations, beside the schema they build."""

from setuptools import find_namespace_packages, setup


def found(directory: str, package: str) -> list[str]:
    """`package` (in `directory`) and every package below it, data-only folders such as ui/static included."""
    below = find_namespace_packages(directory, exclude=["__pycache__", "*.__pycache__"])
    return [package, *(f"{package}.{name}" for name in below)]


setup(
    packages=[
        *found("gateway", "gateway"),
        *found("rollout_store", "rollout_store"),
        *found("migrations", "rollout_store.migrations"),
        *found("trainer_client", "trainer_client"),
        *found("training_data", "training_data"),
    ],
    package_dir={"rollout_store.migrations": "migrations"},
    package_data={"": ["*"]},
    exclude_package_data={"": ["*.py", "*.pyc"]},
)
