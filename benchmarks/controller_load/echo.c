/* The compiled twin of baseline._echo_server: one TCP connection on loopback, 64-byte messages
   echoed back with blocking recv/send. Prints its port, serves one client, and when it goes prints
   the CPU (ns, its process CPU clock) spent after the first argv[1] messages, and exits.
   Its CPU per round trip is what the kernel charges a server for a round trip on this machine. */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { MSG = 64 };

static long long cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    int one = 1;
    long warmup = argc > 1 ? atol(argv[1]) : 0, seen = 0;
    long long start = cpu_ns();
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {0};
    socklen_t len = sizeof addr;
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (listener < 0 || bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1) ||
        getsockname(listener, (struct sockaddr *)&addr, &len)) {
        perror("echo");
        return 1;
    }
    printf("%d\n", ntohs(addr.sin_port));
    fflush(stdout);
    int conn = accept(listener, NULL, NULL);
    close(listener);
    if (conn < 0) {
        perror("echo");
        return 1;
    }
    setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char buf[MSG];
    for (;;) {
        for (int got = 0; got < MSG;) {
            ssize_t n = recv(conn, buf + got, MSG - got, 0);
            if (n <= 0) {
                printf("%lld\n", cpu_ns() - start);
                return 0;
            }
            got += n;
        }
        for (int sent = 0; sent < MSG;) {
            ssize_t n = send(conn, buf + sent, MSG - sent, 0);
            if (n <= 0) {
                printf("%lld\n", cpu_ns() - start);
                return 0;
            }
            sent += n;
        }
        if (++seen == warmup)
            start = cpu_ns();
    }
}
