"""Classify scikit-learn's bundled handwritten digits with jaxops.knn_classify.

Prints the test accuracy next to scikit-learn's KNeighborsClassifier (brute force, uniform
weights) for a few k, and how many predictions agree. Run:  python examples/knn_digits.py
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier

import jaxops


def main() -> None:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0,
                                                        stratify=y)
    refs = jnp.asarray(x_train, jnp.float32)
    queries = jnp.asarray(x_test, jnp.float32)
    labels = jnp.asarray(y_train, jnp.int32)
    classify = jax.jit(jaxops.knn_classify, static_argnums=(3, 4))
    print(f"digits: {len(x_train)} train, {len(x_test)} test, {x.shape[1]} features, "
          f"backend {jax.default_backend()}")
    print(f"{'k':>3} {'jaxops acc':>11} {'sklearn acc':>12} {'agree':>7} {'jaxops ms':>10}")
    for k in (1, 3, 5, 11, 25):
        pred = classify(queries, refs, labels, k, 10).block_until_ready()  # compile
        start = time.perf_counter()
        pred = np.asarray(classify(queries, refs, labels, k, 10).block_until_ready())
        ms = (time.perf_counter() - start) * 1e3
        sk = KNeighborsClassifier(n_neighbors=k, algorithm="brute").fit(x_train, y_train)
        sk_pred = sk.predict(x_test)
        print(f"{k:>3} {np.mean(pred == y_test):>11.4f} {np.mean(sk_pred == y_test):>12.4f} "
              f"{np.mean(pred == sk_pred):>7.3f} {ms:>10.2f}")


if __name__ == "__main__":
    main()
