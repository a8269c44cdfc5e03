"""Submit a training run to SLURM with submitit (pip install submitit), one process per GPU:

    python scripts/submit.py --nodes 2 --gpus_per_node 4 --partition gpu --time 1440 -- --model_type resnet18
    python scripts/submit.py --gpus_per_node 0 --nproc 2 -- --epochs 3     # CPU nodes: gloo, --cpu added
    python scripts/submit.py --cluster local --gpus_per_node 0 -- --epochs 1   # here, in the background

The options after `--` go to train.py. The run is checkpoints/<model>_<data>_submitit_<name> (unless
they give --save_prefix, or --resume FOLDER: that run) and every start passes --resume, so a requeued
job continues it.

submitit asks SLURM for USR2 two minutes before the time limit: the processes save at their next
step, then submitit calls `Trainer.checkpoint` and requeues the job (up to --max_requeues times),
which resumes. A pre-emption ends the processes without a save (SLURM's TERM reaches srun, which kills
them), unless the cluster sends USR2 first (PreemptParameters=send_user_signal with a GraceTime);
SLURM requeues the job, which resumes from the last checkpoint.
"""

import argparse
import contextlib
import io
import os
import re
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Trainer:
    """A submitit job: train.py's main with --resume, in each process of the job."""

    def __init__(self, argv):
        self.argv = list(argv)

    def __call__(self):
        import submitit

        sys.path.insert(0, REPO)
        import train
        from utils.errors import MISTAKE_EXIT_CODE, KilnError
        from utils.stopping import StopSignals

        self._export_distributed_environment(submitit.JobEnvironment())
        requeue = signal.getsignal(signal.SIGUSR2)  # submitit's: calls checkpoint() and requeues (on rank 0)
        warned = []

        def time_limit_near(signum, frame):
            kiln = signal.getsignal(signal.SIGUSR1)
            if isinstance(getattr(kiln, '__self__', None), StopSignals):  # training: save first (at the next step)
                warned.append(signum)
                kiln(signum, frame)
            else:
                requeue(signum, frame)

        signal.signal(signal.SIGUSR2, time_limit_near)
        try:
            run = train.main(['--resume', *self.argv])  # (a --resume FOLDER given after it wins)
        except KilnError as error:  # a mistake found in the job (its data gone, say): a line in its log, not requeued
            rank = os.environ.get('RANK', '0')
            print(f'{"" if rank == "0" else f"rank {rank}: "}error: {error}', file=sys.stderr, flush=True)
            raise SystemExit(MISTAKE_EXIT_CODE) from None
        except SystemExit:  # stopped by a signal, after saving
            if warned:
                requeue(signal.SIGUSR2, None)
            raise
        return {'folder': run.options.model_dir, 'step': run.position.step}

    def checkpoint(self):
        """What the requeued job runs: this again (train.py resumes from the run's last checkpoint)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)

    @staticmethod
    def _export_distributed_environment(job):
        """The variables torchrun would set, from SLURM's (or the local executor's) task numbers; each
        process then takes the GPU of its LOCAL_RANK among all of the node's."""
        os.environ.update(
            RANK=str(job.global_rank),
            WORLD_SIZE=str(job.num_tasks),
            LOCAL_RANK=str(job.local_rank),
            LOCAL_WORLD_SIZE=str(job.num_tasks // job.num_nodes),
        )
        os.environ.setdefault('MASTER_ADDR', job.hostnames[0])
        os.environ.setdefault('MASTER_PORT', str(20000 + int(job.raw_job_id) % 20000))


def parse(argv):
    """This script's options (a mistake: one line, exit code 2) and the train.py options after `--`."""
    sys.path.insert(0, REPO)
    from options import KilnArgumentParser, count_at_least

    parser = KilnArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage='%(prog)s [options] -- [train.py options]',
    )
    parser.add_argument('--nodes', type=count_at_least(1), default=1)
    parser.add_argument(
        '--gpus_per_node', type=count_at_least(0), default=1, help='one process per GPU; 0: CPU nodes (with --cpu)'
    )
    parser.add_argument('--nproc', type=count_at_least(1), default=1, help='processes per node on CPU nodes')
    parser.add_argument('--cpus_per_task', type=count_at_least(1), default=None)
    parser.add_argument('--time', type=count_at_least(1), default=24 * 60, help='time limit in minutes')
    parser.add_argument('--partition', default=None)
    parser.add_argument('--name', default='kiln', help='job name; the run is ..._submitit_<name>')
    parser.add_argument(
        '--folder',
        default=os.path.join(REPO, 'checkpoints', 'submitit'),
        type=os.path.expanduser,
        help="submitit's logs and pickles (default: the project's checkpoints/submitit)",
    )
    parser.add_argument('--cluster', default=None, choices=['slurm', 'local'], help='default: SLURM if found')
    parser.add_argument(
        '--max_requeues',
        type=count_at_least(0),
        default=1000,
        help='how many times the job requeues itself at its time limit (submitit stops after 3 by default)',
    )
    if '--' in argv:
        argv, train_argv = argv[: argv.index('--')], argv[argv.index('--') + 1 :]
    else:
        train_argv = []
    return parser.parse_args(argv), train_argv


def main(argv=None):
    """Submit the job; returns the submitit Job (a mistake, submitit missing or no SLURM here: one line)."""
    args, train_argv = parse(sys.argv[1:] if argv is None else list(argv))  # --help needs no submitit
    from utils.errors import run_cli

    return run_cli(lambda train_argv: submit(args, train_argv), train_argv)


def slurm_executor(args):
    """submitit's executor for --cluster, refusing (KilnError) where there is no SLURM and none was named."""
    from utils.errors import KilnError

    try:
        import submitit
    except ImportError:
        raise KilnError('scripts/submit.py needs submitit: pip install submitit') from None
    try:
        executor = submitit.AutoExecutor(
            folder=args.folder,
            cluster=args.cluster,
            slurm_max_num_timeout=args.max_requeues,
            local_max_num_timeout=args.max_requeues,
        )
    except RuntimeError as error:  # submitit found no SLURM (srun) here
        raise KilnError(
            f'--cluster {args.cluster}: {error}; submit from a SLURM login node, or try it here with --cluster local'
        ) from None
    if args.cluster is None and executor.cluster != 'slurm':  # submitit's fallback: a job in the background here
        raise KilnError(
            'no SLURM here (no srun): submit from a SLURM login node, or give --cluster local to run the job on '
            'this machine'
        )
    return executor


# what submitit writes before sbatch gives the job an id: <uuid>.pkl and .submission_file_<uuid>.sh
SUBMITIT_FILES = re.compile(r'[0-9a-f]{32}\.pkl|\.submission_file_[0-9a-f]{32}\.sh')


@contextlib.contextmanager
def removed_if_refused(made, files_in=None):
    """On an error in the block, remove the files that submitit wrote for it into the folder `files_in` (its
    job file and pickle, named by a new random id: not other jobs' logs and results there) and the folders
    `made` (deepest first) again; sbatch refusing the job (a partition, an account or a time limit it does
    not take) is one line."""
    from utils.errors import KilnError

    independent = None if files_in is None else first_folder_without_job_id(files_in)
    before = set(os.listdir(independent)) if independent and os.path.isdir(independent) else set()
    try:
        yield
    except BaseException as error:
        if independent and os.path.isdir(independent):
            for name in set(os.listdir(independent)) - before:
                if SUBMITIT_FILES.fullmatch(name):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(independent, name))
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        failed = getattr(sys.modules.get('submitit.core.utils'), 'FailedJobError', ())
        if isinstance(error, failed):  # submitit's, with what sbatch said
            said = ' '.join(str(error).split()) or 'no reason given'
            raise KilnError(f'sbatch refused the job: {said}') from None
        raise


def first_folder_without_job_id(folder):
    """The deepest folder above `folder` whose path has no %j, %A, ... in it, where submitit writes its files
    before the job has an id."""
    path = os.path.abspath(folder)
    while '%' in path:
        path = os.path.dirname(path)
    return path


def refuse_other_options(parsed, train_argv):
    """A KilnError when the run the job resumes (its --resume FOLDER, else the one its options name) was
    trained with other options (given in `train_argv`) than a resume may change: its job would be refused
    in the queue, not here."""
    import yaml

    from options import (
        RESUME_LATEST,
        changed_options,
        experiment_folder,
        given_options,
        parse_train_args,
        resolve,
    )
    from utils.checkpoint_keeper import step_of
    from utils.errors import KilnError

    named = parsed.resume not in (None, RESUME_LATEST)
    folder = parsed.resume if named else experiment_folder(resolve(parsed))  # (the model the task decides names it)
    if not any(step_of(file) is not None for file in (os.listdir(folder) if os.path.isdir(folder) else [])):
        return  # nothing trained yet: the job starts the run with these options
    try:
        with open(os.path.join(folder, 'args.yaml')) as f:
            saved = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return  # the job's resume says what is wrong with the folder
    if not isinstance(saved, dict):
        return
    given = given_options(parse_train_args, train_argv)
    changed = [option for option in changed_options(saved, parsed) if option in given]  # (paths as absolute ones)
    if changed:
        shown = ', '.join(f'--{option} {getattr(parsed, option)} (it has {saved.get(option)})' for option in changed)
        raise KilnError(
            f'{shown}: the job resumes {folder}, trained with other options, which a resumed run keeps; give this '
            f'job its own --name (or the options that run was trained with)'
        )


def submit(args, train_argv):
    """Check the train.py options here (a typo: one line now, not in the queue), then submit."""
    from options import RESUME_LATEST, parse_args, parse_train_args
    from utils.errors import KilnError

    resume = parse_args(parse_train_args, train_argv).resume
    named = resume not in (None, RESUME_LATEST)  # --resume FOLDER: that run, not ..._submitit_<name>
    if named and not os.path.isdir(resume):  # a file: each requeue would go back to it
        what = 'not a checkpoint file' if os.path.isfile(resume) else 'there is no such folder'
        raise KilnError(
            f'--resume {resume}: give the experiment folder the job continues (each start and requeue resumes '
            f'its newest checkpoint); {what}'
        )
    name = [] if named else ['--save_prefix', f'submitit_{args.name}']
    train_argv = [*name, *(['--cpu'] if not args.gpus_per_node else []), *train_argv]
    refuse_other_options(parse_args(parse_train_args, train_argv), train_argv)
    made, path = [], os.path.abspath(args.folder)  # the folders submitit will make, deepest first
    while not os.path.exists(path):
        made.append(path)
        path = os.path.dirname(path)
    with removed_if_refused(made):
        executor = slurm_executor(args)
    executor.update_parameters(
        name=args.name,
        nodes=args.nodes,
        tasks_per_node=args.gpus_per_node or args.nproc,
        gpus_per_node=args.gpus_per_node or None,
        cpus_per_task=args.cpus_per_task,
        timeout_min=args.time,
        slurm_partition=args.partition,
        slurm_signal_delay_s=120,
    )
    said = io.StringIO()  # what submitit prints of sbatch's errors: said once, in the refusal's line
    with removed_if_refused(made, executor.folder), contextlib.redirect_stderr(said):
        job = executor.submit(Trainer(train_argv))
    sys.stderr.write(said.getvalue())
    print(f'submitted job {job.job_id}; its output: {job.paths.stdout}', flush=True)
    return job


if __name__ == '__main__':
    main()
