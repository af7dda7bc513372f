/* Holds a process's first loopback connect() until the test lets it go:
 * loaded with LD_PRELOAD into `outpost run` by tests/it/camera_hostile.rs
 * to make the race for a camera relay's loopback port come out the way a
 * hostile local process wins it (it connects first), every time.
 *
 * The first connect() to 127.0.0.1 on a port other than HOLD_EXCEPT_PORT
 * (the camera's own: the daemon connects there first) writes that port to
 * the FIFO HOLD_PORT_FIFO, then waits until the test has opened and closed
 * the FIFO HOLD_GATE_FIFO, then connects. Every other connect() passes
 * straight through. Without the three variables nothing is held. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

static atomic_int held;

static void hold(int port) {
    char line[16];
    int n = snprintf(line, sizeof line, "%d\n", port);
    int w = open(getenv("HOLD_PORT_FIFO"), O_WRONLY);
    if (w >= 0) {
        if (write(w, line, (size_t)n) != n) {
            /* The test reads the port; a short write fails it there. */
        }
        close(w);
    }
    int r = open(getenv("HOLD_GATE_FIFO"), O_RDONLY);
    if (r >= 0) {
        char c;
        while (read(r, &c, 1) > 0) {
        }
        close(r);
    }
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    connect_fn real = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *except = getenv("HOLD_EXCEPT_PORT");
    if (except && getenv("HOLD_PORT_FIFO") && getenv("HOLD_GATE_FIFO") && addr &&
        len >= (socklen_t)sizeof(struct sockaddr_in) && addr->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        int port = ntohs(in->sin_port);
        if (in->sin_addr.s_addr == htonl(INADDR_LOOPBACK) && port != atoi(except) &&
            atomic_exchange(&held, 1) == 0) {
            hold(port);
        }
    }
    return real(fd, addr, len);
}
