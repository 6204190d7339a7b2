"""Train a small ResNet-style network on scikit-learn's digits with jaxops' fused BatchNorm.

Two copies of the same network, same initial parameters and same mini-batches: one uses
``jaxops.batch_norm(..., activation="relu")`` (and the fused BN+Add+ReLU in the residual
block), the other plain-JAX BatchNorm + jax.nn.relu. Both train under ``jax.jit``; the script
checks that the losses agree step by step within float tolerance and prints both step times.

    python examples/resnet_digits.py [--steps 200] [--batch 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import jaxops

EPS = 1e-5


def bn_relu_jax(x, scale, bias, residual=None):
    """Reference: training-mode BatchNorm over N, H, W, then (+ residual) and relu."""
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
    y = (x - mean) * jax.lax.rsqrt(var + EPS) * scale + bias
    if residual is not None:
        y = y + residual
    return jax.nn.relu(y)


def bn_relu_jaxops(x, scale, bias, residual=None):
    return jaxops.batch_norm(x, scale, bias, epsilon=EPS, residual=residual, activation="relu")[0]


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def init(key, width=32, classes=10):
    ks = jax.random.split(key, 5)
    he = lambda k, shape: jax.random.normal(k, shape) * np.sqrt(2.0 / np.prod(shape[:-1]))
    p = {"stem": he(ks[0], (3, 3, 1, width)), "c1": he(ks[1], (3, 3, width, width)),
         "c2": he(ks[2], (3, 3, width, width)), "head": he(ks[3], (width, classes)),
         "head_b": jnp.zeros(classes)}
    for name in ("bn0", "bn1", "bn2"):
        p[name + "_s"] = jnp.ones(width)
        p[name + "_b"] = jnp.zeros(width)
    return p


def forward(p, x, bn_relu):
    h = bn_relu(conv(x, p["stem"]), p["bn0_s"], p["bn0_b"])
    r = bn_relu(conv(h, p["c1"]), p["bn1_s"], p["bn1_b"])
    h = bn_relu(conv(r, p["c2"]), p["bn2_s"], p["bn2_b"], residual=h)  # BN + Add + ReLU
    return jnp.mean(h, axis=(1, 2)) @ p["head"] + p["head_b"]


def make_step(bn_relu, lr):
    def loss_fn(p, x, y):
        logits = forward(p, x, bn_relu)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    @jax.jit
    def step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), loss

    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--rtol", type=float, default=2e-3, help="allowed relative loss difference per step")
    args = ap.parse_args(argv)

    digits = load_digits()
    x_all = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1), NHWC
    y_all = digits.target.astype(np.int32)
    rng = np.random.default_rng(0)

    params = init(jax.random.key(0))
    runs = {"jaxops": [make_step(bn_relu_jaxops, args.lr), params, [], []],
            "pure JAX": [make_step(bn_relu_jax, args.lr), params, [], []]}
    worst = 0.0
    for i in range(args.steps):
        idx = rng.choice(len(x_all), args.batch, replace=False)
        xb, yb = jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx])
        for name, run in runs.items():
            step, p, losses, times = run
            t0 = time.perf_counter()
            p, loss = step(p, xb, yb)
            loss = float(jax.block_until_ready(loss))
            times.append(time.perf_counter() - t0)
            run[1] = p
            losses.append(loss)
        a, b = runs["jaxops"][2][-1], runs["pure JAX"][2][-1]
        worst = max(worst, abs(a - b) / max(abs(b), 1e-6))
        if i % 20 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss jaxops {a:.6f}  pure JAX {b:.6f}")

    for name, run in runs.items():
        t = run[3][2:] or run[3]  # skip compilation
        print(f"{name:>8}: median step {statistics.median(t) * 1e3:.3f} ms")
    acc = {}
    for name, run in runs.items():
        logits = forward(run[1], jnp.asarray(x_all), bn_relu_jaxops if name == "jaxops" else bn_relu_jax)
        acc[name] = float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(y_all)))
    print(f"train accuracy (batch statistics): jaxops {acc['jaxops']:.3f}  pure JAX {acc['pure JAX']:.3f}")
    print(f"largest relative loss difference over {args.steps} steps: {worst:.2e}")
    if worst > args.rtol:
        print("FAIL: losses diverged")
        return 1
    print("OK: losses agree step by step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
