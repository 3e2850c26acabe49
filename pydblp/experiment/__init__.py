"""The main job: train real models over Gloo, static bounded loss and DBLP under microbursts."""
