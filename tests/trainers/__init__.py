"""Scripts the trainers' interpreter runs (``.venv-trainers``: no pytest there), and what
they share with the tests that run them."""
