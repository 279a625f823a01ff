"""Training recipes: ``registry`` (the recipes as data; no framework) and ``build`` (the torch
objects a recipe makes). Import the module you need: this package loads neither."""
