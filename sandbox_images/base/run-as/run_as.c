/*
 * run-as UID GID PROGRAM [ARG...]: become UID:GID with no supplementary groups, in /, then
 * exec PROGRAM. The exec agent (orchestrator/sandbox/agent/exec_agent.py) starts every
 * command through it with posix_spawn, which vforks: Python's subprocess cannot switch
 * users without a full fork of the agent, and that fork was most of what the agent added
 * to a command (runc: 1.6 ms of 2.8 for `true`; gVisor: about 6 ms). This program has no
 * libc (raw system calls only): an exec of it costs about 0.1 ms under runc and 0.5 ms
 * under gVisor, where a static glibc build of it costs 3 ms.
 *
 * What it does is what subprocess.Popen(user=, group=, extra_groups=[], cwd="/",
 * close_fds=True) does in its child: setgroups(0), setresgid, setresuid (all three ids, so
 * no saved id keeps root), chdir("/"), every descriptor above 3 closed. The agent checks at
 * its start that this file and its directories are root's and written by nobody else, and
 * never runs it otherwise.
 *
 * Capabilities: the agent has emptied its bounding set, so an exec gives root only what
 * the agent holds inheritable, and the agent holds exactly CAP_SETUID and CAP_SETGID so
 * (exec_agent.keep_inheritable): this program can switch users with them and nothing else.
 * Once the ids are switched the kernel has cleared its permitted and effective sets; it
 * clears the inheritable set too, so the command starts with no capability in any set,
 * as a command started by fork did.
 *
 * Descriptor 3, when open, is the agent's error pipe (Popen's errpipe): it is closed by a
 * successful exec, and a failure writes its errno there (4 bytes, native order) before
 * exiting 126 (the switch failed) or 127 (PROGRAM could not be executed), so the agent
 * raises the same OSError a failed Popen would. A message goes to standard error too.
 */
typedef long word;

#if defined(__x86_64__)
enum {
  SYS_WRITE = 1, SYS_EXECVE = 59, SYS_EXIT = 60, SYS_FCNTL = 72, SYS_CHDIR = 80,
  SYS_SETGROUPS = 116, SYS_SETRESUID = 117, SYS_SETRESGID = 119, SYS_CAPSET = 126,
  SYS_CLOSE_RANGE = 436,
};
static word syscall3(word n, word a, word b, word c) {
  word ret;
  __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
  return ret;
}
__asm__(".text\n.global _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n"
        " call run_as\n hlt\n");
#elif defined(__aarch64__)
enum {
  SYS_WRITE = 64, SYS_EXECVE = 221, SYS_EXIT = 93, SYS_FCNTL = 25, SYS_CHDIR = 49,
  SYS_SETGROUPS = 159, SYS_SETRESUID = 147, SYS_SETRESGID = 149, SYS_CAPSET = 91,
  SYS_CLOSE_RANGE = 436,
};
static word syscall3(word n, word a, word b, word c) {
  register word x8 __asm__("x8") = n;
  register word x0 __asm__("x0") = a;
  register word x1 __asm__("x1") = b;
  register word x2 __asm__("x2") = c;
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
  return x0;
}
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x0, sp\n and sp, x0, #-16\n"
        " bl run_as\n brk #0\n");
#else
#error "run-as: no system call table for this architecture"
#endif

enum { ERROR_PIPE = 3, F_SETFD = 2, FD_CLOEXEC = 1, EINVAL = 22 };

/* capset(2)'s header and the two words of data of _LINUX_CAPABILITY_VERSION_3. */
struct cap_header { unsigned version; int pid; };
struct cap_data { unsigned effective, permitted, inheritable; };

static int error_pipe_open;

static word length(const char *s) {
  word n = 0;
  while (s[n]) n++;
  return n;
}

/* Report errno ``error`` (a positive number) on the error pipe and standard error; exit. */
static void fail(int code, word error, const char *why) {
  if (error_pipe_open) {
    int value = (int)error;
    syscall3(SYS_WRITE, ERROR_PIPE, (word)&value, sizeof value);
  }
  syscall3(SYS_WRITE, 2, (word)why, length(why));
  for (;;) syscall3(SYS_EXIT, code, 0, 0);
}

/* A decimal id, or -1 for anything else (an empty string, a sign, other characters). */
static word parse_id(const char *s) {
  word value = 0;
  if (!*s) return -1;
  for (; *s; s++) {
    if (*s < '0' || *s > '9' || value > 0x7fffffff / 10) return -1;
    value = value * 10 + (*s - '0');
  }
  return value;
}

__attribute__((used)) void run_as(word *stack) {
  word argc = stack[0];
  char **argv = (char **)(stack + 1);
  char **envp = argv + argc + 1;
  word ret;
  error_pipe_open = syscall3(SYS_FCNTL, ERROR_PIPE, F_SETFD, FD_CLOEXEC) == 0;
  /* Older kernels lack close_range: the agent's descriptors are close-on-exec anyway. */
  syscall3(SYS_CLOSE_RANGE, ERROR_PIPE + 1, ~0UL >> 1, 0);
  if (argc < 4) fail(126, EINVAL, "run-as: usage: run-as UID GID PROGRAM [ARG...]\n");
  word uid = parse_id(argv[1]);
  word gid = parse_id(argv[2]);
  /* Never root: the agent's commands must not be able to signal or replace it. */
  if (uid <= 0 || gid <= 0) fail(126, EINVAL, "run-as: UID and GID must be positive numbers\n");
  if ((ret = syscall3(SYS_SETGROUPS, 0, 0, 0)) != 0) fail(126, -ret, "run-as: setgroups failed\n");
  if ((ret = syscall3(SYS_SETRESGID, gid, gid, gid)) != 0)
    fail(126, -ret, "run-as: setresgid failed\n");
  if ((ret = syscall3(SYS_SETRESUID, uid, uid, uid)) != 0)
    fail(126, -ret, "run-as: setresuid failed\n");
  struct cap_header header = {0x20080522, 0};
  struct cap_data none[2] = {{0, 0, 0}, {0, 0, 0}};
  if ((ret = syscall3(SYS_CAPSET, (word)&header, (word)none, 0)) != 0)
    fail(126, -ret, "run-as: capset failed\n");
  if ((ret = syscall3(SYS_CHDIR, (word)"/", 0, 0)) != 0) fail(126, -ret, "run-as: chdir failed\n");
  ret = syscall3(SYS_EXECVE, (word)argv[3], (word)(argv + 3), (word)envp);
  fail(127, -ret, "run-as: cannot execute the program\n");
}
