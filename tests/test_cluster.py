"""Outgrowing one machine, tested without a cluster: two torchrun "nodes" on localhost (gloo on the
CPU), scripts/slurm_train.sh under stand-in SLURM commands (srun, scontrol, scancel, sbatch), and
scripts/submit.py on submitit's local executor."""

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import uuid

import pytest
import torch

from conftest import REPO, run_files, run_script, timeout, tiny_run_args

TORCHRUN = [sys.executable, '-m', 'utils.torchrun']
# the linear model has no BatchNorm, whose batch statistics would differ between 1 x 16 and 2 x 8 images
LINEAR_SGD = ['--model_type', 'linear', '--optimizer', 'sgd', '--lr', '0.05', '--epochs', '1']


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _start(command, log, env=None):
    """Start `command` in the repository with its output in the file `log`; returns the Popen."""
    with open(log, 'w') as out:
        return subprocess.Popen(
            command,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})},
        )


def _finish(process, log):
    """Wait for `process`; returns its output (the test fails, with the output, on a non-zero exit)."""
    process.wait(timeout=timeout(300))
    with open(log) as f:
        output = f.read()
    assert process.returncode == 0, output[-5000:]
    return output


def _folder(checkpoints, name='default'):
    return os.path.join(checkpoints, f'linear_list_{name}')


def _last(folder):
    return torch.load(os.path.join(folder, 'last.pth'), weights_only=True, map_location='cpu')


def _step(folder):
    return _last(folder)['position']['step']


def _assert_same_weights(a, b, atol):
    for name, tensor in a['model'].items():
        assert torch.allclose(tensor.float(), b['model'][name].float(), atol=atol, rtol=0), name


# --- two nodes on localhost -----------------------------------------------------------------------


@pytest.fixture(scope='module')
def one_machine_and_two_nodes(tiny_shapes, tmp_path_factory):
    """The same training as 1 process x 16 images, 1 node x 2 processes x 8, and 2 nodes x 1 process x 8,
    run side by side: {'single'|'one_node'|'two_nodes': (checkpoints folder, output)}."""
    root = tmp_path_factory.mktemp('cluster')
    args = {name: tiny_run_args(tiny_shapes, root / name) + LINEAR_SGD for name in ('single', 'one_node', 'two_nodes')}
    port, rdzv_id = _free_port(), uuid.uuid4().hex
    nodes = [
        '--nnodes',
        '2',
        '--nproc-per-node',
        '1',
        '--rdzv-backend',
        'c10d',
        '--rdzv-endpoint',
        f'127.0.0.1:{port}',
        '--rdzv-id',
        rdzv_id,
    ]
    runs = {
        'single': [_start([sys.executable, 'train.py', *args['single']], root / 'single.log')],
        'one_node': [
            _start(
                [
                    *TORCHRUN,
                    '--standalone',
                    '--nproc-per-node',
                    '2',
                    'train.py',
                    *args['one_node'],
                    '--batch_size',
                    '8',
                ],
                root / 'one_node.log',
            )
        ],
        # both nodes run in the same folder and write to the same checkpoints folder, as on a shared file system
        'two_nodes': [
            _start(
                [*TORCHRUN, *nodes, '--node-rank', str(rank), 'train.py', *args['two_nodes'], '--batch_size', '8'],
                root / f'node{rank}.log',
            )
            for rank in (0, 1)
        ],
    }
    outputs = {}
    for name, processes in runs.items():
        logs = [root / f'{name}.log'] if name != 'two_nodes' else [root / 'node0.log', root / 'node1.log']
        outputs[name] = ''.join(_finish(process, log) for process, log in zip(processes, logs))
    return {name: (args[name][args[name].index('--checkpoints_dir') + 1], outputs[name]) for name in runs}


def test_two_nodes_train_like_one_node_and_like_one_process(one_machine_and_two_nodes):
    states = {name: _last(_folder(checkpoints)) for name, (checkpoints, _) in one_machine_and_two_nodes.items()}
    assert {name: state['position']['step'] for name, state in states.items()} == dict.fromkeys(states, 6)
    _assert_same_weights(states['two_nodes'], states['one_node'], atol=1e-5)
    _assert_same_weights(states['two_nodes'], states['single'], atol=1e-5)
    with open(os.path.join(_folder(one_machine_and_two_nodes['two_nodes'][0]), 'run_config.json')) as f:
        config = json.load(f)
    assert config['world_size'] == 2 and config['total_batch_size'] == 16


def test_only_global_rank_zero_writes(one_machine_and_two_nodes):
    """Both nodes' processes have LOCAL_RANK 0; only the one with RANK 0 writes and prints."""
    checkpoints, output = one_machine_and_two_nodes['two_nodes']
    single = one_machine_and_two_nodes['single'][0]
    assert os.listdir(checkpoints) == ['linear_list_default']  # one experiment folder
    assert run_files(_folder(checkpoints)) == run_files(_folder(single))  # one event file, no per-node copies
    assert run_files(_folder(checkpoints)).count('events') == 1
    with open(os.path.join(_folder(checkpoints), 'reproduce.json')) as f:
        assert len(json.load(f)) == 1
    assert output.count('done after') == 1  # one report, from global rank 0


# A torchrun worker's ending, as train.py, eval.py and predict.py end: DDP, collectives, the process group
# left, then run_to_exit. DDP keeps gloo's threads alive past destroy_process_group; one that lets go of a
# collective's tensor while the interpreter tears down aborts the process (SIGABRT, "terminate called
# without an active exception"): CI saw it once, and with this script under load it happened in 14 of 16
# runs with Python's usual exit (and in both cases of this test).
DDP_WORKER = """
import sys, torch, torch.distributed as dist
from utils.distributed import cleanup_distributed, init_distributed
from utils.errors import KilnError, run_to_exit

def main(argv):
    init_distributed(cpu=True)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    model(torch.randn(4, 3)).sum().backward()
    for _ in range(50):
        dist.all_reduce(torch.ones(1000))
    cleanup_distributed()
    print('left the group' if not dist.is_initialized() else 'still in it')  # buffered: flushed at the end
    if argv == ['fail']:
        raise KilnError('a one-line error')

run_to_exit(main)
"""


@pytest.mark.parametrize('ending', ['success', 'fail'])
def test_torchrun_workers_end_with_their_status_and_never_abort(ending, tmp_path):
    """Under load, every worker exits with its own status (0, or 2 after a one-line error said once) and its
    output."""
    script = tmp_path / 'worker.py'
    script.write_text(DDP_WORKER)
    busy = [
        subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(2)
    ]  # load makes the abort likely
    try:
        result = subprocess.run(
            [
                *TORCHRUN,
                '--standalone',
                '--nproc-per-node',
                '2',
                str(script),
                *(['fail'] if ending == 'fail' else []),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)},
            timeout=timeout(120),
        )
        output = result.stdout + result.stderr
        assert 'terminate called' not in output and 'SIGABRT' not in output, output[-3000:]
        if ending == 'success':
            assert result.returncode == 0, output[-3000:]
            assert output.count('left the group') == 2  # each worker's buffered output got out
        else:
            assert result.returncode == 2, output[-3000:]
            assert output.count('error: a one-line error') == 1, output[-3000:]  # rank 0's; rank 1 waited for it
    finally:
        for process in busy:
            process.kill()
            process.wait()


# a worker whose save, once stopped, takes longer than torchrun's shutdown timeout (set to 1 s here)
SLOW_SAVE_WORKER = """
import os, signal, sys, time
stop = []
signal.signal(signal.SIGINT, lambda *_: stop.append(1))
open(sys.argv[1] + '.ready', 'w').close()
while not stop:
    time.sleep(0.05)
time.sleep(3)  # a validation, a save to a slow disk
open(sys.argv[1] + '.saved', 'w').close()
sys.exit(130)
"""


def test_torchrun_gives_stopped_workers_time_to_save(tmp_path):
    """torchrun SIGKILLs the workers still running --shutdown-timeout (30 s) after it passed a stop on: a
    long validation or a slow save lost the stop's checkpoint (SLURM's warning comes 120 s before the
    limit). utils.torchrun gives them STOP_GRACE_SECONDS."""
    script, marker = tmp_path / 'worker.py', tmp_path / 'worker'
    script.write_text(SLOW_SAVE_WORKER)
    launcher = subprocess.Popen(
        [*TORCHRUN, '--standalone', '--nproc-per-node', '1', str(script), str(marker)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, 'PYTHONPATH': str(REPO), 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT': '1'},
    )
    try:
        deadline = time.monotonic() + timeout(60)
        while not os.path.exists(f'{marker}.ready') and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        output = launcher.communicate(timeout=timeout(60))[0]
    finally:
        launcher.kill()
    assert os.path.exists(f'{marker}.saved'), output[-3000:]
    assert launcher.returncode == 130 and 'torchrun: stopped by SIGINT' in output, output[-3000:]


# a worker that used a thread pool (torch.compile's inductor compiles in one): idle pool threads are not
# daemons, and only threading's own exit hook stops them
POOL_WORKER = """
import concurrent.futures, sys
from utils.errors import run_to_exit

POOL = concurrent.futures.ThreadPoolExecutor(2)  # kept for the process's life, as inductor keeps its own

def main(argv):
    print(POOL.submit(lambda: 'computed').result())

run_to_exit(main)
"""


def test_a_torchrun_worker_that_used_a_thread_pool_exits(tmp_path):
    """run_to_exit joined every non-daemon thread before threading's exit hooks: a --compile run under
    torchrun finished, printed its report and never exited."""
    script = tmp_path / 'worker.py'
    script.write_text(POOL_WORKER)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, 'WORLD_SIZE': '2', 'PYTHONPATH': str(REPO)},  # a worker's ending, without a job
        timeout=timeout(30),
    )
    assert result.returncode == 0 and result.stdout == 'computed\n', result.stderr


@pytest.mark.parametrize(
    'exits, blamed, line',
    [
        # torchrun SIGTERMs the survivors after a failure: the SIGKILLed worker is the cause, even in a tie
        ({0: -15, 1: -9}, 1, 'rank 1 was killed by SIGKILL (signal 9); often the out-of-memory killer'),
        ({0: 1, 1: -9}, 1, 'rank 1 was killed by SIGKILL'),  # rank 0 then failed on the broken connection
        ({0: -15, 1: 2}, 1, 'rank 1 failed with exit code 2 (its error is above)'),
        ({0: 2, 1: 2}, 0, 'rank 0 failed with exit code 2'),
        ({0: 143, 1: 2}, 1, 'rank 1 failed with exit code 2'),  # rank 0 stopped by that SIGTERM, as Kiln exits
        # a SIGTERM to one worker: every worker stops alike; it said 'rank 0 failed ... (its error is above)'
        ({0: 143, 1: 143}, 0, 'ranks 0, 1 stopped on SIGTERM, exit code 143'),
        ({0: 138, 1: 138}, 0, 'ranks 0, 1 stopped on SIGUSR1, exit code 138'),  # SLURM's: said 'its error is above'
        # a worker that went down with its lost peer (exit 3, PEER_LOST_EXIT_CODE) comes after one with an error
        ({0: 3, 1: 2}, 1, 'rank 1 failed with exit code 2 (its error is above)'),  # of its own (exit 2) ...
        ({0: 3, 1: 1}, 1, 'rank 1 failed with exit code 1'),  # ... or a traceback (exit 1): it is the cause
        ({0: 2, 1: 3}, 0, 'rank 0 failed with exit code 2'),
        ({0: 3, 1: 3, 2: 143}, 0, 'rank 0 failed with exit code 3'),  # no error of their own: the lowest rank
    ],
)
def test_torchrun_names_the_worker_that_caused_the_failure(exits, blamed, line, monkeypatch, capsys):
    """torchrun records failures in whole seconds, so ties are common: the worker that caused the failure
    wins them (killed by a signal, then an error of its own), not the ones that went down with it (lost
    their peer, or were stopped by torchrun's SIGTERM), nor the lowest rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import utils.torchrun

    failures = {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file='')
        for rank, code in exits.items()
    }
    for failure in failures.values():
        failure.timestamp = 1  # the same second

    def failed_job(options):
        raise ChildFailedError('train.py', failures)

    monkeypatch.setattr(utils.torchrun.torchrun, 'run', failed_job)
    with pytest.raises(SystemExit) as exit_info:
        utils.torchrun.main(['train.py'])
    code = exits[blamed]
    assert exit_info.value.code == (code if code > 0 else 128 - code)
    error = capsys.readouterr().err
    assert error.startswith(f'torchrun: {line}') and error.count('\n') == 1, error


# rank 1 fails with an error of its own; rank 0 then goes down with it through run_cli, as a collective on
# the closed connection does, a moment later: torchrun's next check sees both
PEER_LOST_WORKER = """
import os, sys, time
from utils.errors import run_cli

marker = sys.argv[1]
if os.environ['RANK'] == '1':
    print('rank 1: error: a data error of its own', file=sys.stderr, flush=True)
    open(marker, 'w').close()
    os._exit(2)

def main(argv):
    while not os.path.exists(marker):
        time.sleep(0.01)
    time.sleep(0.05)
    raise RuntimeError('[gloo] Connection closed by peer [127.0.0.1]:1234')

run_cli(main, [])
"""


def test_torchrun_names_the_failed_rank_not_the_one_that_lost_it(tmp_path):
    """The job ends with rank 1's exit code and names it, though rank 0 failed (went down with it) too.
    That is the tie-break under test only when torchrun saw both failures at one look (the same second:
    without the tie-break rank 0 would win it); if it looked between the two exits, it saw rank 1's alone
    (and stopped rank 0 itself), so the run is repeated until its own log line (the first failure by time,
    the lowest rank in a tie) names rank 0's exit 3."""
    script = tmp_path / 'worker.py'
    script.write_text(PEER_LOST_WORKER)
    for attempt in range(5):
        marker = tmp_path / f'rank1_failed_{attempt}'
        result = subprocess.run(
            [
                *TORCHRUN,
                '--standalone',
                '--nproc-per-node=2',
                '--monitor-interval=1',  # both workers are gone by torchrun's next look, most times
                str(script),
                str(marker),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)},
            timeout=timeout(120),
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, result.stderr[-3000:]
        assert lines[-1] == 'torchrun: rank 1 failed with exit code 2 (its error is above)', result.stderr[-3000:]
        if 'failed (exitcode: 3) local_rank: 0 ' in result.stderr:  # torch's line: both failures, tied
            return
    pytest.fail(f'torchrun never saw both failures at one look in 5 runs; the last:\n{result.stderr[-3000:]}')


COUNTED_WORKER = """
import errno, sys
from utils.errors import TRAINING_STEPS, KilnError, run_cli
with open(sys.argv[1], 'a') as f:
    f.write('started\\n')
if sys.argv[2] == 'trained':
    TRAINING_STEPS.append(1.0)

def main(argv):
    if argv[0] == 'crash':
        raise ZeroDivisionError
    if argv[0] == 'disk':
        raise OSError(errno.EIO, 'Input/output error', 'checkpoints/a/last.pth')
    raise KilnError('--train_list x.txt does not exist')

run_cli(main, sys.argv[3:])
"""


@pytest.mark.parametrize(
    'error, when, code, starts',
    [
        ('mistake', 'set up', 2, 1),  # an option, a missing file: said once
        ('disk', 'set up', 2, 1),
        ('disk', 'trained', 2, 3),  # a network disk's hiccup while training: resumed from the last checkpoint
        ('crash', 'set up', 1, 3),
    ],
)
def test_torchrun_restarts_after_a_crash_not_after_a_mistake(tmp_path, error, when, code, starts):
    """A mistake (an option, a missing file) was said again by each of --max-restarts' starts (4 times
    under scripts/slurm_train.sh, a rendezvous each); a crash, or an error met while training, is still
    started again."""
    script, starts_file = tmp_path / 'worker.py', tmp_path / 'starts.txt'
    script.write_text(COUNTED_WORKER)
    result = subprocess.run(
        [
            *TORCHRUN,
            '--standalone',
            '--nproc-per-node=1',
            '--max-restarts=2',
            '--monitor-interval=0.1',
            script,
            starts_file,
            when,
            error,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)},
        timeout=timeout(120),
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert starts_file.read_text().count('started') == starts, result.stderr[-3000:]


# --- scripts/slurm_train.sh under stand-in SLURM commands -------------------------------------------

STANDINS = {
    # records its arguments, skips its options and runs the command once per node (here: on this machine)
    'srun': r"""
echo "srun $*" >> "$SLURM_STANDIN_LOG"
while [[ "$1" == -* ]]; do shift; done
[ -z "${SLURM_STANDIN_DRY:-}" ] || exit 0
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    pids+=($!)
done
printf '%s\n' "${pids[@]}" > "$SLURM_STANDIN_STEP"
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
""",
    # scancel --signal=SIG JOB: like SLURM (with proctrack/cgroup), signal every process of the job step
    # (what srun started and everything below it), but not the batch script
    'scancel': r"""
echo "scancel $*" >> "$SLURM_STANDIN_LOG"
signal=${1#--signal=}
tree() { echo "$1"; local child; for child in $(ps -o pid= --ppid "$1"); do tree "$child"; done; }
for pid in $(cat "$SLURM_STANDIN_STEP"); do
    for p in $(tree "$pid"); do kill -s "$signal" "$p" 2>/dev/null || true; done
done
""",
    'scontrol': r"""
echo "scontrol $*" >> "$SLURM_STANDIN_LOG"
if [ "$1 $2" = "show hostnames" ]; then tr ',' '\n' <<< "$3"; fi
""",
    # runs the job at once, in the foreground, as the batch shell (so its PID is the job script's)
    'sbatch': r"""
echo "sbatch $*" >> "$SLURM_STANDIN_LOG"
while [[ "$1" == -* ]]; do shift; done
export SLURM_SUBMIT_DIR=$PWD
exec bash "$@"
""",
}


class StandInSlurm:
    """A folder of stand-in SLURM commands, and jobs submitted through them (one node, this machine)."""

    def __init__(self, folder):
        self.folder = folder
        os.makedirs(folder / 'bin')
        for name, text in STANDINS.items():
            path = folder / 'bin' / name
            path.write_text('#!/usr/bin/env bash\n' + text.lstrip())
            path.chmod(0o755)
        self.jobs = 0

    def env(self, job_id, name, **extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'SRUN_'))}
        return {
            **env,
            'PATH': f'{self.folder / "bin"}{os.pathsep}{env["PATH"]}',
            'PYTHON': sys.executable,
            'OMP_NUM_THREADS': '1',
            'RDZV_PORT': str(_free_port()),
            'SLURM_STANDIN_LOG': str(self.folder / f'{job_id}.log'),
            'SLURM_STANDIN_STEP': str(self.folder / f'{job_id}.step'),
            'SLURM_JOB_ID': str(job_id),
            'SLURM_JOB_NAME': name,
            'SLURM_JOB_NODELIST': '127.0.0.1',
            'SLURM_JOB_NUM_NODES': '1',
            **extra,
        }

    def submit(self, name, args, job_id=None, **extra_env):
        """`sbatch scripts/slurm_train.sh ARGS` (the same job_id again: a requeue); returns the Job."""
        if job_id is None:
            self.jobs += 1
            job_id = 4000 + self.jobs
        env = self.env(job_id, name, **extra_env)
        output = self.folder / f'{job_id}.{name}.{time.monotonic_ns()}.out'
        with open(output, 'w') as out:
            process = subprocess.Popen(
                ['sbatch', 'scripts/slurm_train.sh', *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        return Job(self, job_id, process, output, env)

    def commands(self, job_id):
        """The SLURM commands the job ran, one line each."""
        with open(self.folder / f'{job_id}.log') as f:
            return f.read().splitlines()


class Job:
    def __init__(self, slurm, job_id, process, output, env):
        self.slurm, self.id, self.process, self.output, self.env = slurm, job_id, process, output, env

    def scancel(self, signame):
        subprocess.run(
            [str(self.slurm.folder / 'bin' / 'scancel'), f'--signal={signame}', str(self.id)],
            env=self.env,
            check=True,
            timeout=timeout(60),
        )

    def wait_for(self, path):
        deadline = time.time() + timeout(300)
        while not os.path.exists(path):
            assert self.process.poll() is None, self.read()[-5000:]
            assert time.time() < deadline, f'no {path}'
            time.sleep(0.02)

    def finish(self):
        """Wait for the job's end; returns its output (the test fails on a non-zero exit status)."""
        try:
            self.process.wait(timeout=timeout(300))
        finally:
            self.stop()
        assert self.process.returncode == 0, self.read()[-5000:]
        return self.read()

    def stop(self):
        if self.process.poll() is None:  # a hang, or a failed test: end the whole job
            self.scancel('KILL')
            self.process.kill()
            self.process.wait()

    def read(self):
        with open(self.output) as f:
            return f.read()


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
    return StandInSlurm(tmp_path_factory.mktemp('slurm'))


STEPS = 24


def _job_args(shapes, checkpoints):
    """Tiny training options for a job: 24 steps of 8 images, a checkpoint after every step (which also
    makes each step slow enough to be interrupted in the middle of the run); the script adds --cpu."""
    return (
        [a for a in tiny_run_args(shapes, checkpoints) if a != '--cpu']
        + LINEAR_SGD
        + ['--batch_size', '8', '--max_iteration', str(STEPS), '--save_interval', '1', '--loggers', 'csv']
    )


@pytest.fixture(scope='module')
def whole_job(slurm, tiny_shapes, tmp_path_factory):
    """An uninterrupted job, (job, its checkpoints folder), left running beside the tests that compare
    with it (job.finish() waits for it)."""
    checkpoints = tmp_path_factory.mktemp('whole')
    job = slurm.submit('whole', _job_args(tiny_shapes, checkpoints))
    yield job, checkpoints
    job.stop()


def _whole_state(whole_job):
    job, checkpoints = whole_job
    job.finish()
    return _last(_folder(checkpoints, 'slurm_whole'))


def test_time_limit_warning_saves_and_the_requeued_job_continues(slurm, whole_job, tiny_shapes, tmp_path):
    """120 s before the time limit SLURM sends USR1 to the job script (--signal=B:USR1@120): every
    process saves, the script requeues the job, and the requeued job (the same script again) goes on."""
    args = _job_args(tiny_shapes, tmp_path)
    folder = _folder(tmp_path, 'slurm_parts')
    job = slurm.submit('parts', args)
    job.wait_for(os.path.join(folder, 'last.pth'))  # training has started
    os.kill(job.process.pid, signal.SIGUSR1)
    output = job.finish()
    assert 'stopped by SIGINT' in output and 'interrupted' not in output, output[-3000:]
    assert slurm.commands(job.id)[-2:] == [f'scancel --signal=USR2 {job.id}', f'scontrol requeue {job.id}']
    stopped_at = _step(folder)
    assert 0 < stopped_at < STEPS

    requeued = slurm.submit('parts', args, job_id=job.id).finish()
    assert requeued.split('resuming ', 1)[1].splitlines()[0].endswith(f': step {stopped_at}/{STEPS}')
    assert _step(folder) == STEPS  # where the uninterrupted job ended, with the same weights
    _assert_same_weights(_last(folder), _whole_state(whole_job), atol=1e-6)


def test_a_term_to_every_process_saves_and_torchrun_restarts_from_it(slurm, whole_job, tiny_shapes, tmp_path):
    """scancel --signal=TERM (and --signal=TERM) sends TERM to every process of the job step,
    torchrun and its workers alike: each worker must get it once (torchrun ignores it instead of passing on
    a second one, which would stop Kiln unsaved). The worker saves and exits; here, where no SLURM ends the
    job, torchrun's --max-restarts start it again and it resumes from that checkpoint."""
    folder = _folder(tmp_path, 'slurm_pre')
    job = slurm.submit('pre', _job_args(tiny_shapes, tmp_path))
    job.wait_for(os.path.join(folder, 'last.pth'))
    job.scancel('TERM')
    output = job.finish()
    assert output.count('stopped by SIGTERM') == 1 and 'interrupted' not in output, output[-3000:]
    stopped_at = int(output.split('stopped by SIGTERM', 1)[1].split(' at step ', 1)[1].split()[0])
    assert 0 < stopped_at < STEPS and output.count('resuming') == 1
    assert output.split('resuming ', 1)[1].splitlines()[0].endswith(f': step {stopped_at}/{STEPS}')
    assert _step(folder) == STEPS and 'requeue' not in ' '.join(slurm.commands(job.id))
    _assert_same_weights(_last(folder), _whole_state(whole_job), atol=1e-6)


def test_slurm_job_trains_into_its_experiment_folder(slurm, whole_job):
    job, checkpoints = whole_job
    output = job.finish()
    assert os.listdir(checkpoints) == ['linear_list_slurm_whole']  # <model>_<data>_slurm_<job name>
    assert _step(_folder(checkpoints, 'slurm_whole')) == STEPS and 'done after' in output
    commands = slurm.commands(job.id)
    assert commands[0].startswith('sbatch scripts/slurm_train.sh')
    assert commands[1] == 'scontrol show hostnames 127.0.0.1'
    srun = commands[2]
    assert srun.startswith('srun ') and len(commands) == 3  # no scancel, no requeue
    for part in (
        '-m utils.torchrun --nnodes=1 --nproc-per-node=1 --rdzv-backend=c10d',
        f'--rdzv-endpoint=127.0.0.1:{job.env["RDZV_PORT"]} --rdzv-id={job.id} --max-restarts=',
        'train.py --save_prefix slurm_whole --resume --cpu --data_type list',
    ):
        assert part in srun, srun


@pytest.mark.parametrize(
    'gpus, nproc, processes, cpu',
    [
        (None, None, 1, True),  # a CPU node: one process, gloo on the CPU
        (None, '3', 3, True),
        ('4', None, 4, False),
        ('a100:2', None, 2, False),
        ('0', None, 1, True),
    ],
)
def test_slurm_script_picks_the_processes_per_node(slurm, gpus, nproc, processes, cpu):
    extra = {
        'SLURM_STANDIN_DRY': '1',
        **({'SLURM_GPUS_PER_NODE': gpus} if gpus else {}),
        **({'NPROC': nproc} if nproc else {}),
    }
    job = slurm.submit('dry', ['--epochs', '1'], **extra)  # srun only records what it would run
    job.finish()
    srun = slurm.commands(job.id)[-1]
    assert f'--nproc-per-node={processes} ' in srun and ('--resume --cpu ' in srun) == cpu, srun


# --- scripts/submit.py with submitit's local executor ------------------------------------------------


@pytest.mark.skipif(shutil.which('srun') is not None, reason='a SLURM machine: this would submit a job')
def test_submit_without_slurm_is_one_line(tmp_path):
    """submitit's 'Could not detect srun' came as a 15-line traceback; the refusal left the folder that
    submitit had made for its logs."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    logs = tmp_path / 'checkpoints' / 'submitit' / '%j'  # folders submitit makes, three deep
    result = subprocess.run(
        [sys.executable, 'scripts/submit.py', '--folder', logs, '--cluster', 'slurm', '--', '--epochs', '1'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    assert result.returncode == 2 and result.stderr.count('\n') == 1, result.stderr
    assert result.stderr.startswith('error: --cluster slurm: ') and '--cluster local' in result.stderr
    # without --cluster, submitit fell back to a job in the background on this machine, without a word
    result = subprocess.run(
        [sys.executable, 'scripts/submit.py', '--folder', logs, '--', '--epochs', '1'],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    assert result.returncode == 2 and result.stderr.startswith('error: no SLURM here (no srun)'), result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('folder', ['jobs/%j', 'existing'])
def test_a_job_sbatch_refuses_is_one_line_and_leaves_nothing(tmp_path, folder):
    """sbatch refusing the job (a partition, account or time limit it does not take) was submitit's 43-line
    traceback, and its job file and pickle stayed in the log folder."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    bin_folder = tmp_path / 'bin'
    bin_folder.mkdir()
    for name, body in {
        'srun': 'exit 0',
        'sbatch': 'echo "sbatch: error: invalid partition specified: nosuch" >&2; exit 1',
    }.items():
        (bin_folder / name).write_text(f'#!/bin/sh\n{body}\n')
        (bin_folder / name).chmod(0o755)
    (tmp_path / 'existing').mkdir()
    (tmp_path / 'existing' / 'mine.txt').write_text('kept')
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob('*'))
    result = subprocess.run(
        [
            sys.executable,
            'scripts/submit.py',
            '--folder',
            tmp_path / folder,
            '--partition',
            'nosuch',
            '--',
            '--epochs',
            '1',
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, 'PATH': f'{bin_folder}{os.pathsep}{os.environ["PATH"]}'},
        timeout=timeout(60),
    )
    assert result.returncode == 2 and result.stderr == (
        'error: sbatch refused the job: sbatch: error: invalid partition specified: nosuch\n'
    ), result.stderr
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob('*')) == before


@pytest.mark.parametrize(
    'option, line',
    [
        (['--gpus_per_node', '-1'], 'error: argument --gpus_per_node: must be 0 or more, got -1 (see --help)'),
        (['--nproc', '0'], 'error: argument --nproc: must be a positive integer, got 0 (see --help)'),
        (['--nodes', 'two'], 'error: argument --nodes: must be a positive integer, got two (see --help)'),
    ],
)
def test_submit_refuses_resources_that_are_no_count_in_one_line(tmp_path, option, line):
    """--gpus_per_node -1 was submitit's IndexError traceback; --nodes 0 and --nproc 0 were submitted."""
    result = subprocess.run(
        [sys.executable, 'scripts/submit.py', '--folder', tmp_path / 'jobs', '--cluster', 'local', *option],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    assert result.returncode == 2 and result.stderr == line + '\n', result.stderr
    assert os.listdir(tmp_path) == []


def _children(pid):
    return [
        int(child)
        for child in subprocess.run(
            ['ps', '-o', 'pid=', '--ppid', str(pid)], capture_output=True, text=True
        ).stdout.split()
    ]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_submitit_job_saves_and_requeues_itself_before_the_time_limit(whole_job, tiny_shapes, tmp_path):
    """A job on submitit's local executor; USR2 to its process, as SLURM sends it to every process before
    the time limit (submitit's --signal=USR2@120): it saves at the next step, submitit calls
    Trainer.checkpoint and requeues the job, and the requeued job resumes and ends like an uninterrupted one."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    jobs = tmp_path / 'jobs'
    # (the output to a file: the local job's controller keeps the submitting process's stdout open)
    submit = _start(
        [
            sys.executable,
            'scripts/submit.py',
            '--cluster',
            'local',
            '--gpus_per_node',
            '0',
            '--name',
            'test',
            '--folder',
            str(jobs),
            '--time',
            '30',
            '--',
            *_job_args(tiny_shapes, tmp_path / 'ck'),
        ],
        tmp_path / 'submit.log',
    )
    controller = int(_finish(submit, tmp_path / 'submit.log').split('submitted job ', 1)[1].split(';')[0])
    folder = _folder(tmp_path / 'ck', 'submitit_test')  # the local job's id is its controller's PID
    try:
        deadline = time.time() + timeout(300)
        while not os.path.exists(os.path.join(folder, 'last.pth')):  # training has started
            assert _alive(controller) and time.time() < deadline, 'the job ended or hung before training'
            time.sleep(0.02)
        tasks = _children(controller)
        assert len(tasks) == 1
        os.kill(tasks[0], signal.SIGUSR2)
        while _alive(controller):  # the requeued job runs under the same controller
            assert time.time() < deadline, 'the job did not end'
            time.sleep(0.1)
    finally:
        for pid in [*_children(controller), controller]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    output = (jobs / f'{controller}_0_log.out').read_text()
    assert output.count('stopped by SIGUSR2') == 1 and output.count('resuming') == 1, output
    assert 'Calling checkpoint method' in output and 'Requeued job' in output, output  # submitit's log
    with open(jobs / f'{controller}_0_result.pkl', 'rb') as f:
        assert pickle.load(f) == ('success', {'folder': folder, 'step': STEPS})
    _assert_same_weights(_last(folder), _whole_state(whole_job), atol=1e-6)


def test_submitit_processes_get_torchruns_variables(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location('kiln_submit', os.path.join(REPO, 'scripts', 'submit.py'))
    submit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(submit)
    monkeypatch.setattr(os, 'environ', {})
    job = types.SimpleNamespace(
        global_rank=5, num_tasks=8, local_rank=1, num_nodes=2, hostnames=['n1', 'n2'], raw_job_id='123'
    )
    submit.Trainer._export_distributed_environment(job)
    assert os.environ == {
        'RANK': '5',
        'WORLD_SIZE': '8',
        'LOCAL_RANK': '1',
        'LOCAL_WORLD_SIZE': '4',
        'MASTER_ADDR': 'n1',
        'MASTER_PORT': '20123',
    }


def test_submit_checks_the_train_options_before_submitting(tmp_path):
    """A typo was submitted (a queue wait on SLURM) and only failed in the job's log."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    result = run_script(
        'scripts/submit.py',
        '--cluster',
        'local',
        '--gpus_per_node',
        '0',
        '--folder',
        tmp_path / 'jobs',
        '--',
        '--batchsize',
        '8',
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        'error: unrecognized arguments: --batchsize 8 (did you mean --batch_size?) (see --help)'
    ], result.stderr
    assert not (tmp_path / 'jobs').exists()  # nothing submitted


def test_submit_refuses_options_the_run_it_resumes_was_not_trained_with(tiny_shapes, tmp_path):
    """Every job resumes its run (..._submitit_<name>): a second submission with another --lr was
    submitted, then refused in the queue, with a traceback in its log."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    args = tiny_run_args(tiny_shapes, tmp_path / 'ck') + ['--cpu', '--epochs', '1']
    trained = run_script('train.py', *args, '--save_prefix', 'submitit_mine')
    assert trained.returncode == 0, trained.stderr
    submit = ['scripts/submit.py', '--cluster', 'local', '--gpus_per_node', '0', '--name', 'mine']
    result = run_script(*submit, '--folder', tmp_path / 'jobs', '--', *args, '--lr', '0.5')
    assert result.returncode == 2 and result.stderr.startswith('error: --lr 0.5 (it has 0.003): the job resumes '), (
        result.stderr
    )
    assert 'give this job its own --name' in result.stderr and not (tmp_path / 'jobs').exists()


def test_a_submitted_resume_continues_the_folder_it_names(tiny_shapes, tmp_path):
    """`-- --resume FOLDER` was overridden by the bare --resume every start adds after it: the job trained a
    new run (..._submitit_kiln) from step 0 and left the named one as it was. Now the job continues it,
    its options are checked against that run's before submitting, and a checkpoint file (which each
    requeue would go back to) is refused."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    args = _job_args(tiny_shapes, tmp_path / 'ck')
    trained = run_script('train.py', *args, '--cpu', '--save_prefix', 'mine', '--max_iteration', '8')
    assert trained.returncode == 0, trained.stderr
    folder = _folder(tmp_path / 'ck', 'mine')
    submit = ['scripts/submit.py', '--cluster', 'local', '--gpus_per_node', '0', '--folder', tmp_path / 'jobs', '--']
    refused = run_script(*submit, '--resume', os.path.join(folder, 'last.pth'))
    assert refused.returncode == 2 and refused.stderr.startswith(f'error: --resume {folder}/last.pth: give the'), (
        refused.stderr
    )
    refused = run_script(*submit, *args, '--resume', folder, '--lr', '0.5')
    assert refused.returncode == 2 and f'the job resumes {folder}, trained with other options' in refused.stderr
    assert not (tmp_path / 'jobs').exists()
    job = _start([sys.executable, *submit, '--resume', folder, '--max_iteration', '12'], tmp_path / 'submit.log')
    controller = int(_finish(job, tmp_path / 'submit.log').split('submitted job ', 1)[1].split(';')[0])
    deadline = time.time() + timeout(300)
    while _alive(controller):
        assert time.time() < deadline, 'the job did not end'
        time.sleep(0.1)
    output = (tmp_path / 'jobs' / f'{controller}_0_log.out').read_text()
    assert f'resuming {folder}' in output and _step(folder) == 12, output[-3000:]
    assert os.listdir(tmp_path / 'ck') == ['linear_list_mine']


def test_submitted_jobs_requeue_at_every_time_limit(tmp_path):
    """submitit requeues a job after at most 3 time limits unless told otherwise: a long run ended unfinished
    ('timed-out too many times'), where slurm_train.sh requeues until it is done."""
    pytest.importorskip('submitit', reason='submitit is not installed (pip install submitit)')
    import importlib.util

    spec = importlib.util.spec_from_file_location('kiln_submit', os.path.join(REPO, 'scripts', 'submit.py'))
    submit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(submit)
    for option, expected in (([], 1000), (['--max_requeues', '5'], 5)):
        args, _ = submit.parse(['--cluster', 'local', '--folder', str(tmp_path / 'jobs'), *option])
        assert submit.slurm_executor(args)._executor.max_num_timeout == expected
