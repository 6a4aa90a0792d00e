from setuptools import find_packages, setup

setup(
    name="transformers_async_stop",
    version="0.1.0",
    description="Sync-free stopping criteria for HuggingFace generate(): the host reads the stop flag one step late.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["transformers_async_stop", "transformers_async_stop.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=4.57.6,<6", "accelerate"],
    extras_require={"test": ["pytest", "parameterized"]},
)
