"""An RTSP camera on loopback for the tests: raw BGR frames on stdin, served as JPEG over RTP
by GStreamer's RTSP server at rtsp://127.0.0.1:<port>/cam (RTP's JPEG payload wants 4:2:0,
hence the I420 conversion).

Run with the system python3 (Debian's python3-gst-1.0, gir1.2-gst-rtsp-server-1.0 and
gstreamer1.0-plugins-good): ``/usr/bin/python3 rtsp_server.py PORT WIDTH HEIGHT FPS``.
ffmpeg alone cannot serve RTSP to a client that pulls.  Frames that arrive while no client
is watching are dropped, as a camera's are.
"""

import sys
import threading

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main() -> None:
    port, width, height, fps = sys.argv[1], *map(int, sys.argv[2:5])
    Gst.init(None)
    size = width * height * 3
    caps = f"video/x-raw,format=BGR,width={width},height={height},framerate={fps}/1"
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(f"( appsrc name=src is-live=true do-timestamp=true format=time "
                       f"caps={caps} ! videoconvert ! video/x-raw,format=I420 ! "
                       "jpegenc quality=90 ! rtpjpegpay name=pay0 pt=96 )")
    factory.set_shared(True)
    sources: list = []

    def configure(_factory, media) -> None:
        sources.append(media.get_element().get_child_by_name("src"))
    factory.connect("media-configure", configure)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(port)
    server.get_mount_points().add_factory("/cam", factory)
    server.attach(None)

    def pump() -> None:
        stdin = sys.stdin.buffer
        while True:
            data = stdin.read(size)
            if len(data) < size:
                break
            if sources:
                sources[-1].emit("push-buffer", Gst.Buffer.new_wrapped(data))
        loop.quit()
    loop = GLib.MainLoop()
    threading.Thread(target=pump, daemon=True).start()
    print("ready", flush=True)
    loop.run()


if __name__ == "__main__":
    main()
