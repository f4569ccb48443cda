"""Native kernels: C++ sources (`cpu/*.cpp`, `cpu/*.h`) and the one builder that compiles
them (`build.py`)."""
