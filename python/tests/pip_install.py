"""pip install . as a user does it: a fresh venv, the checkout installed into it, then one
zoffload.torch step against a real zoffloadd, from outside the source and build trees and
without a library path.  python3 pip_install.py SOURCE_DIR (meson sets $ZOFFLOADD).

The venv sees the system's site-packages, so the torch it steps with is the system's (Debian's
python3-torch); pip itself builds in isolation, fetching meson-python as any user's pip does.
The step is checked against torch.optim.AdamW on the same gradient to test_numerics's RTOL.
"""
import os
import subprocess
import sys
import tempfile

STEP = r'''
import os, sys
try:
    import torch
except ImportError:
    print("skipped: the system python has no torch to step with")
    sys.exit(77)
import zoffload, zoffload.torch as zt, zoffload._zclient as zc
venv = sys.argv[1]
for mod in (zoffload, zc):
    assert os.path.realpath(mod.__file__).startswith(os.path.realpath(venv)), mod.__file__
sys.path.append(sys.argv[2])            # the tests' helpers, for the daemon only
import zhelpers
d = zhelpers.Daemon()
try:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    q = torch.nn.Parameter(p.detach().clone())
    opt = zt.AdamW([p], lr=1e-2, job="pip", socket=d.socket)
    ref = torch.optim.AdamW([q], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(1000)
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    err = ((p - q).abs().max() / q.abs().max()).item()
    assert err <= 2.0 ** -18, err
    assert not torch.equal(p.detach(), torch.zeros(1000))
    opt.close()
finally:
    d.stop()
print("stepped through the installed package:", zoffload.__file__)
'''


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main():
    if os.environ.get("ZOFFLOAD_PY_SKIP"):
        print("skipped: " + os.environ["ZOFFLOAD_PY_SKIP"])
        return 77
    src = os.path.abspath(sys.argv[1])
    tests = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="zoff-pip-") as tmp:
        venv = os.path.join(tmp, "venv")
        run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv])
        py = os.path.join(venv, "bin", "python")
        # What the build's tests run with must not reach the installed package.
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
        run([py, "-m", "pip", "install", "-q", "--no-deps", src], env=env, cwd=tmp)
        # libzclient is inside the extension: nothing to find on a library path.
        ext = subprocess.run([py, "-c", "import zoffload._zclient as z; print(z.__file__)"],
                             env=env, cwd=tmp, check=True, capture_output=True,
                             text=True).stdout.strip()
        needed = subprocess.run(["readelf", "-d", ext], check=True, capture_output=True,
                                text=True).stdout
        assert "libzclient" not in needed, needed
        return subprocess.run([py, "-c", STEP, venv, tests], env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
