"""`pdserve serve`'s refusals of flags the model cannot take: a usage error before any process starts."""
import socket
import subprocess
import sys


def test_a_tensor_parallel_size_the_model_cannot_take_is_a_usage_error_without_a_traceback():
    """It was refused by the engine process, with its traceback after the message (hostile review)."""
    with socket.socket() as sock:   # a free port: were the check late, the server would start on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--tensor-parallel-size", "2",
                           "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "pdserve serve: tensor_parallel_size: 2 does not divide the model's 9 query heads" in done.stderr
    assert "sizes that do: 1, 3" in done.stderr and "Traceback" not in done.stderr, done.stderr
