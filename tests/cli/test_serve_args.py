"""`pdserve serve`'s refusals of flags the model cannot take: a usage error before any process starts."""
import socket
import subprocess
import sys


def test_a_tensor_parallel_size_the_model_cannot_take_is_a_usage_error_without_a_traceback():
    """It was refused by the engine process, with its traceback after the message (hostile review)."""
    # a free port: were the check late, the server would start on it
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--tensor-parallel-size", "2",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "pdserve serve: tensor_parallel_size: 2 does not divide the model's 9 query heads" in done.stderr
    assert "sizes that do: 1, 3" in done.stderr and "Traceback" not in done.stderr, done.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_max_model_len_past_the_models_limit_is_refused_in_one_line():
    """It was capped to the model's 8,192 without a word (new-user check, session 50); an engine's start-up
    error that is the user's to fix came with the engine process's traceback after it."""
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--max-model-len", "100000",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert ("pdserve serve: engine failed to start: ValueError: max_model_len 100000 is more than this model's "
            "limit of 8192 tokens") in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
