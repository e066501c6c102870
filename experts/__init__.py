"""The experts: models and expert kinds. Importing the package registers its tiny models'
builders (experts/tiny/)."""
from experts import tiny  # noqa: F401
